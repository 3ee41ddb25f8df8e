"""The margin a choice made by timing must clear: a padded step size, a linear-layer kernel, a precision."""

PICK_GAIN = 0.9  # a timed choice needs a 10 % gain: a smaller gap is within timing noise
