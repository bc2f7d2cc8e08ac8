"""The registry: the service (``aiorl-registry``) and the client every process uses.

Layer: above ``transport`` and ``protocol``; below ``runtime``.
"""
