"""Systems layer of hstu: the compiled extension, KV ops, paged attention and the KV cache manager."""
