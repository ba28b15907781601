"""`kiln data prepare`: tokenizing corpora in parallel into the packed-document layout."""
