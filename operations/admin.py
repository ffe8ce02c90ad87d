"""The front page of the admin is the operators' dashboard: fleet figures, what needs attention, charts
(operations/dashboard.py, shown by the template below)."""
from django.contrib import admin

admin.site.index_template = "admin/gpumarket_index.html"
admin.site.site_header = "GPU Marketplace operators"
admin.site.site_title = "GPU Marketplace operators"
admin.site.index_title = "Dashboard"
