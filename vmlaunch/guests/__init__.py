"""What a real guest needs: base images fetched and checked (`images`), its cloud-init seed
(`cloudinit`), SSH keys and pinned host keys (`sshkeys`), the rules for disk files (`diskfiles`) and
for shares (`sharerules`, `shareaccess`).
"""
