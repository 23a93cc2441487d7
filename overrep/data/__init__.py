"""Training text and features: documents (text), packing into token rows (packing), the on-disk feature cache (cache_*)."""
