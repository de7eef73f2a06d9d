"""Pipeline parallelism: the model cut into stages of contiguous blocks, one or more per pipeline rank."""
