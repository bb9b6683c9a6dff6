# SPDX-License-Identifier: Apache-2.0
"""What the tier asks of the host: the native build cache (`build_cache`), the CUDA driver API
(`cuda_driver`) and directories it may trust (`paths`)."""
