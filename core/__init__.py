"""What every app may use and no app owns: core imports no app."""
