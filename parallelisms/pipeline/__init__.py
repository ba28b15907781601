"""Pipeline parallelism: stage split, schedules, checks, the stage runner."""
