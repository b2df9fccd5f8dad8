"""OpenAI batches over batchgen jobs: the create-batch body, the batch record and its
lifecycle, validation in the background, the output files, removal."""
