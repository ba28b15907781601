"""Step guards (kind ``guard``): decide from global step statistics whether to skip or abort."""
