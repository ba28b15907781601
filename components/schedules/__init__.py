"""LR schedules: pure functions of the step giving a multiplier of each group's peak LR."""
