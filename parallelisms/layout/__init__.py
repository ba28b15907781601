"""Layout checks and planning: what a [parallelism] layout allows and costs."""
