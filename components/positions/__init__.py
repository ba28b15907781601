"""Position encodings applied inside attention (kind ``position``)."""
