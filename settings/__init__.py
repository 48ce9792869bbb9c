"""The one typed config (pydantic) and the YAML reading, shared by ``actors`` and ``cluster``.

A leaf package: it imports neither ``engine``, ``actors``, ``cluster`` nor ``bench``.
"""
