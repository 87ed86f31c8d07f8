"""Fault tolerance: what a rank answers to a stall notice."""


def rank_state(step, seq, op="step_boundary", bucket=-1, open_seq=0, open_op="none", open_s=0.0):
    """A rank's answer to a stall notice, as the monitor collects it (the flight recorder's part)."""
    return {"step": step, "seq": seq, "op": op, "bucket": bucket, "open_seq": open_seq, "open_op": open_op,
            "open_bucket": bucket if open_seq else -1, "open_s": open_s}
