"""The speculative decoding loop, its pipelined variant, the draft-length policy and round timing."""
