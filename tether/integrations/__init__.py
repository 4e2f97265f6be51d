"""Adapters that run tether's objectives inside other training engines (verl, TRL).

Each adapter imports its engine lazily; the core never imports them.
"""
