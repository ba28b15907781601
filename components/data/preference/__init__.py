"""Preference data: prompts with a chosen and a rejected completion (DPO and its family)."""
