"""Rule tables, one file per category: bounded ops (value ranges), observer choice, fusions.

Each table is a module-level list of rules; the engines that apply them are the passes in
``lucid_fx.passes``. User registrations (``lucid_fx.register_*``) add to copies of these tables
held by a :class:`lucid_fx.Registry`; a later registration wins.
"""
