"""The Triton model repository a build serves from.

    package.py        the package stage (PACKAGE): the repository, its manifest and requirements
    triton_config.py  config.pbtxt, written with tritonclient's ModelConfig
    chat_template.py  the checkpoint's chat template, checked and carried into the manifest
    environment.py    the environment stage (ENVIRONMENT): the serving packages for the container's Python
"""
