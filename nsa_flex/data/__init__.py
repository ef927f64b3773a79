"""The data path of nsa_flex, one job per module (no torchtitan import; the trainer's loaders are
nsa_flex/titan/data.py):

  errors.py       DatasetError, the one user error of the data path
  documents.py    doc_ids_from_tokens: document index of every position of packed rows
  passkey.py      the passkey retrieval corpus (documents, synthetic filler, a sharded source)
  files.py        which local files a dataset_path names (file, folder, glob; FIFOs and devices refused)
  records.py      reading local records with their file and line / row; bad records; the up-front check
  hub_probe.py    whether the Hugging Face hub answers
  text_source.py  tokenized documents of a ``datasets`` stream, sharded by node
  sources.py      dataset name + path -> source
  packing.py      sources -> samples of seq_len + 1 tokens, passkey mix, exact resume state
"""
