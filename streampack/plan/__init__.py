"""Who reads what: which samples each reader reads, how many batches it yields, and how a reader resumes.

Nothing here is a ``BaseNode``; the nodes call it (the modules are listed in ``docs/development.md``).
"""
