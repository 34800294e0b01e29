"""Who reads what: which samples each reader reads, how many batches it yields, and how a
reader resumes. Nothing here is a ``BaseNode``; the nodes (:mod:`streampack.nodes`) call it.

- Where this process sits: :mod:`.topology` (rank, worker, readers).
- Which samples each reader reads in each epoch: :mod:`.sharding` (pure assignment arithmetic),
  :mod:`.epoch_plan` (a finite epoch's plan from the manifest), :mod:`.quota` (its batch quota,
  settled late), :mod:`.cost_seed` (the cost histogram every balancing reader starts from).
- What the ranks and processes agree on: :mod:`.agree` (per-epoch batch counts through the
  job's TCPStore), :mod:`.sync` (equal step counts at run time), :mod:`.passes` (which pass a
  DataLoader worker runs).
- How a reader resumes: :mod:`.state` (the versioned state envelope and the reference table a
  carried sample is saved as), :mod:`.replay` (re-reading carried documents from their
  references), :mod:`.rows` (a document as a row of named int64 fields: the form every document
  travels in from the overlong node to the collate), :mod:`.elastic` and :mod:`.reshard` (the states of every reader of a run
  -> each new reader's share on another topology).

A window's carry (the samples a packer holds between rounds) lives in its packer node
(``nodes.window_packer.WindowPacker``), which alone changes it.
Outside the node it exists only as a reference table (:func:`.state.samples_to_table`): the
packer's state writes it, :mod:`.replay` turns it back into documents on
restore, and :mod:`.elastic` / :mod:`.reshard` may read and split it, between runs only, to give
an old reader's carried samples to new readers. Nothing else touches it.
"""
