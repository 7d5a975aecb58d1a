"""A self-contained demo: a tiny paged-KV transformer engine (``engine``) and
the two-engine document-QA scenario (``run``) that ``kvtier demo`` runs."""
