"""Examples of the researcher's own components, used by ``conf/experiment/*`` (``+experiment=digits_cnn``)."""
