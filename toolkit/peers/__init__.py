"""Peers to compare against, run under the same conditions as our runner: `memlimit` runs any
command under a memory limit that includes page cache (cgroup v1), from a cold page cache, and
measures what it read and how much memory it held; `llamacpp` builds llama.cpp from the
llama-cpp-python sdist, converts our checkpoints to GGUF and runs them greedily."""
