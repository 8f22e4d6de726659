"""The pod tier: what several services of one pod share (cluster index, peer fetch,
shared flash). One node needs none of it."""
