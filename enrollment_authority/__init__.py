"""The enrollment authority: certifies devices' signing keys. Not the aggregation server (which
must not be able to make a device), so the orchestrator never imports it; in production the app
platform's attestation service plays this part."""
