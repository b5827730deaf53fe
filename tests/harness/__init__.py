"""Test harness: process launchers, servers and fault injectors shared by the test tiers."""
