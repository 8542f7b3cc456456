"""The lab as the user wrote it: the frozen typed model (`model`, the only home of defaults), static
addresses (`addresses`) and the loader that reads a TOML spec into the model or reports every problem
with its line (`load`, with the JSON schema beside it); the image catalog (`catalog`) and the starter
spec `vmlaunch init` writes (`starter`). Pure: it reads the spec file (and the catalog) and nothing else.
"""
