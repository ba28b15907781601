"""Model families (kind ``model``) and the blocks they share."""
