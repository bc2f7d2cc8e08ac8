"""The node agent (``aiorl-node``) and its warm zygote, which spawn and supervise workers.

Layer: beside ``cluster``, above ``actors`` (the zygote hosts worker processes).
"""
