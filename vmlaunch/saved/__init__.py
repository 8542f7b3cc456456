"""Saved state: snapshots of a whole lab, disks and RAM at one instant, their warm start
(`snapshot`), and the intent a save or a restore writes before it pauses anything (`intent`).
"""
