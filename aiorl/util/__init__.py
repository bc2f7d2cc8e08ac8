"""Small helpers with no aiorl dependencies (the bottom layer, beside ``errors`` and ``names``)."""
