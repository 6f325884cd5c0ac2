"""Distributed discrete DP for secure aggregation: every site encodes its records' clipped
gradients as integers (``encoding``) and adds a share of Skellam noise (``skellam``) so that the
sum of all sites' vectors — the only thing secure aggregation reveals — carries a central
curator's noise. The masks themselves are in ``peer.net.secagg`` (they need the site identity);
the accounting is in ``peer.dp.accounting.skellam``. Pure: arrays in, arrays out, randomness
passed in.
"""

from peer.dp.distributed.encoding import (
    Encoding,
    decode_sum,
    encode_records,
    encode_sum,
    modular_overflow_probability,
    round_records,
    rounded_l1_bound,
    rounded_l2_bound,
    smallest_bits,
    to_modular,
)
from peer.dp.distributed.skellam import SkellamCalibration, calibrate_share, skellam_share

__all__ = [
    "Encoding",
    "SkellamCalibration",
    "calibrate_share",
    "decode_sum",
    "encode_records",
    "encode_sum",
    "modular_overflow_probability",
    "round_records",
    "rounded_l1_bound",
    "rounded_l2_bound",
    "skellam_share",
    "smallest_bits",
    "to_modular",
]
