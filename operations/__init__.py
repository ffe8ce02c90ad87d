"""What operators and the demo need across every app: the admin's front page (the fleet dashboard) and the demo's
seed. The one place allowed to read every app (marketplace, provisioning, billing); no app imports it."""
