# placeholder
space() { die "todo"; }
fault() { die "todo"; }
guard() { die "todo"; }
