"""The one error type of the FP8 export: a user mistake with a one-line message naming the fix."""


class QuantizeError(ValueError):
    """Bad input to the quantizer (model directory, calibration data, options, ModelOpt version)."""
