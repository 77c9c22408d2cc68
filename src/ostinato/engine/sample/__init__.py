"""Sampling: the one owner of how a step's tokens are chosen (greedy in the graph, sampling
graphs, eager sampling)."""
