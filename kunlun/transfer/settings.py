"""``config.transfer`` validation: defined in ``kunlun.configs.transfer`` (importable by
``kunlun.train`` without ``kunlun.transfer``); re-exported here for the transfer code."""

from kunlun.configs.transfer import JOIN_KEYS, TransferConfig, parse_transfer

__all__ = ["JOIN_KEYS", "TransferConfig", "parse_transfer"]
