#ifndef KEYBAGFS_CSODIUM_SHIM_H
#define KEYBAGFS_CSODIUM_SHIM_H
#include <sodium.h>
#endif
