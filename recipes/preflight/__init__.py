"""What a run is checked for before its first step, one code path for `kiln train` and
`kiln validate`: the batch plan, the data, the model and its adapter."""
