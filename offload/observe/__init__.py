# SPDX-License-Identifier: Apache-2.0
"""What the tier shows of itself: live Prometheus metrics (`metrics`), the start-up report and
its timeline (`report`, `timeline`) and rank-tagged logs (`log`).  Nothing here is on the copy
path."""
