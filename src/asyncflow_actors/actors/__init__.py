"""The actor runtime: typed mailboxes, ask/tell, OTP supervision, remote nodes."""
