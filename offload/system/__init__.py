# SPDX-License-Identifier: Apache-2.0
"""What the tier asks of the host: shared-memory segments (`shm`) and their hand-off between
processes without a name (`nameless`), the native build cache (`build_cache`), the CUDA driver
API (`cuda_driver`) and directories it may trust (`paths`)."""
