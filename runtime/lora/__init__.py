"""LoRA adapters served on the base model (issue 54, docs/lora.md): the runtime's side.

    sites.py    the site table (where each branch sits) and the branch's input names
    stacks.py   an adapter's identity (AdapterRef) and weights per site; a step's adapters stacked into slots
    files.py    an adapter's file in the model repository (safetensors, written and read with NumPy)
    store.py    the adapters a model knows and those in host memory: an LRU with reference counts
    check.py    an adapter file checked against the served sites and lora.max_rank (loaded at run time)
    index.py    the repository store's adapters beside the versions (<model>/adapters/index.json)
"""
