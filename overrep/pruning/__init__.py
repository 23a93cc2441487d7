"""Which blocks to remove: one module per pruning criterion behind one registry (:mod:`.registry`)."""
