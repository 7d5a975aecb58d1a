"""Sans-IO wire protocol: messages, codec, packed arrays, errors, block hashes."""

from .arrays import HASH_BYTES, pack_hashes, pack_ids, unpack_hashes, unpack_ids
from .codec import decode, encode, error_reply
from .errors import ErrorCode, ProtocolError, side_of
from .hashing import block_hashes, chain_hash
from .messages import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, TABLE

__all__ = [
    "HASH_BYTES", "MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "TABLE", "ErrorCode",
    "ProtocolError", "block_hashes", "chain_hash", "decode", "encode", "error_reply",
    "pack_hashes", "pack_ids", "side_of", "unpack_hashes", "unpack_ids",
]
