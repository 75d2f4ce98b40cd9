"""Data: TFDS datasets read without TensorFlow, the SentencePiece tokenizer, packed batches.

`datasets.load(name, split)` gives random-access text; `tokenizer.Tokenizer` turns it into ids;
`pipeline.PackedBatches` packs the ids into resumable, sharded `int32[batch, seq_len + 1]` batches.
Import the submodules: `from spsjax.data import datasets, pipeline, tokenizer`.
"""
