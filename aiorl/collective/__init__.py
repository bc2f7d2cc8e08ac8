"""Collectives over worker groups: broadcast (RLinf's ``Worker.broadcast``).

Sits above ``group`` and ``p2p`` (it moves bytes through the P2P engine and shared memory) and
below ``weights`` and ``actors``.
"""
