"""Text in and out of token ids, without torch: the tokenizer, its chat template, and the
incremental detokenizer with stop strings."""
