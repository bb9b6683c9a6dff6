# SPDX-License-Identifier: Apache-2.0
"""The control plane: who the ranks are (`topology`), what they agreed (`plan`), how rank 0
reaches every rank's actor (`rpc`), and how jobs are numbered, tracked and decided alike on every
rank (`jobs`, `board`, `quorum`, `stores`)."""
