# Palisade uvn SPANK plugin (C). Include from the top-level Makefile:
#   include internal/dataplane/uvn/spank/spank.mk
# and add $(SPANK_SO) to `build`. Needs gcc and libslurm-dev (<slurm/spank.h>).
CC          ?= gcc
SPANK_SO    := bin/pal_uvn_spank.so
SPANK_FLAGS := -Wall -Wextra -Werror -O2 -g -D_FORTIFY_SOURCE=2 -fPIC -shared -Wl,-z,relro,-z,now

$(SPANK_SO): internal/dataplane/uvn/spank/c/pal_uvn_spank.c
	@mkdir -p $(dir $@)
	$(CC) $(SPANK_FLAGS) -o $@ $<
