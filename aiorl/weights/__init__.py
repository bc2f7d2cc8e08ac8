"""Versioned weight publication (``aiorl.weights``): trainer ranks publish, rollout ranks pull.

Sits above ``collective`` and ``channels`` and below ``actors``.
"""
