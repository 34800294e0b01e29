"""Who reads what: which samples each reader reads, how many batches it yields, and how a reader resumes.

Nothing here is a ``BaseNode``; the nodes call it (the modules are listed in ``docs/development.md``).
A window's carry lives in its packer node, which alone changes it; outside the node it exists only as
a reference table (:func:`.state.samples_to_table`) that :mod:`.replay` turns back into documents and
:mod:`.elastic` / :mod:`.reshard` split between new readers, between runs only.
"""
