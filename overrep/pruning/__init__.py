"""Which blocks to remove: the pruning criteria behind one registry (CRITERIA)."""
